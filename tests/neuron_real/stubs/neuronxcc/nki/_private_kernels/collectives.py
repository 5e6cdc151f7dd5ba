"""Stub of neuronxcc.nki._private_kernels.collectives.CollectivesConfig.

NxD calls `CollectivesConfig(replica_groups=cp_groups).rank_src_tgt_pairs[rank]` unconditionally in
initialize_model_parallel (parallel_state.py:740-742) to precompute ring-attention send/recv pairs.
This is a small re-implementation of only that attribute: each replica group is a ring
g[i] -> g[(i+1) % len(g)], and every rank maps to the sorted (src, tgt) pairs of its own ring.
(The value is only consumed by the NKI ring-attention kernel, which is not available here.)
"""


class CollectivesConfig:
    def __init__(self, src_tgt_pairs=None, replica_groups=None):
        if src_tgt_pairs and replica_groups:
            raise ValueError("Only one of src_tgt_pairs or replica_groups should be provided.")
        pairs = list(src_tgt_pairs or [])
        for g in replica_groups or []:
            pairs += [(g[i], g[(i + 1) % len(g)]) for i in range(len(g))]
        self.src_tgt_pairs = sorted(pairs)
        succ = {}
        for s, t in self.src_tgt_pairs:
            succ.setdefault(s, []).append(t)
        self.rank_src_tgt_pairs = {}
        for r in sorted({x for p in self.src_tgt_pairs for x in p}):
            seen, edges, stack = set(), [], [r]
            while stack:
                n = stack.pop()
                if n in seen:
                    continue
                seen.add(n)
                for t in succ.get(n, []):
                    edges.append((n, t))
                    stack.append(t)
            self.rank_src_tgt_pairs[r] = sorted(edges)
