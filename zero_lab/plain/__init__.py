"""ZeRO with nothing else, for reading: stages 0-3, one short file each, plain `dist` calls.

Read `partition.py` first (the flat buffer, the owned slice, freeing and regrowing memory,
the buckets), then `stage0.py` (hooks, buckets, an all-reduce), `stage1.py` (a reduce-scatter,
a step on the owned slice, an all-gather), `stage2.py` (stage 0's hooks sending stage 1's
reduce-scatter) and `stage3.py` (units gathered just in time). Each opens with its step as a
table and is called as the real one is: `model, opt = stage2.shard(model, make_optimizer,
bucket_mb=25)`, then `loss.backward(); opt.step(); opt.zero_grad()`.

The real stages (`zero_lab.stages.shard`, zero_lab/stages/) are this mechanism plus what a
real implementation needs: overlap of the parameter all-gathers, prefetch, the lockstep and
agreement checks, refusals, gradient accumulation and no_sync, precision policies, clipping,
checkpoints, the direct exchange on gloo. tests/test_plain.py holds the two together: the same
weights as one process and as `shard()`, the same collectives and bytes per step, at N = 2, 3.
Here: one backward per step, fp32, every trainable parameter used, no tied weights, and (at
stage 3) each unit returns one tensor.
"""
