"""FAKE neuronx_distributed.parallel_layers.loss_functions.parallel_cross_entropy at tensor parallelism 1.

As the real one (loss_functions.py:10-129, :217-219): per-token losses with the target's shape,
unreduced; no ignore_index (a target outside the vocabulary gets a predicted logit of 0, so a
loss of log-sum-exp and the softmax as gradient); the input logits are shifted in place.
"""
import torch


class _ParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing=0.0):
        logits = vocab_parallel_logits
        logits.sub_(logits.max(dim=-1, keepdim=True).values)  # in place, as loss_functions.py:23
        vocab = logits.shape[-1]
        in_range = (target >= 0) & (target < vocab)
        predicted = torch.where(in_range, logits.gather(-1, target.clamp(0, vocab - 1).unsqueeze(-1)).squeeze(-1),
                                torch.zeros_like(target, dtype=logits.dtype))
        exp = logits.exp()
        sum_exp = exp.sum(-1)
        loss = torch.log(sum_exp) - predicted
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), target, in_range)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target, in_range = ctx.saved_tensors
        grad = softmax.clone()
        one_hot = torch.zeros_like(grad).scatter_(-1, target.clamp(0, grad.shape[-1] - 1).unsqueeze(-1), 1.0)
        grad = grad - one_hot * in_range.unsqueeze(-1).float()
        return grad * grad_output.unsqueeze(-1), None, None


def parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0):
    return _ParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing)
