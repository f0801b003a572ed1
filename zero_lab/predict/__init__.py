"""PREDICTED: what training needs and costs, from formulas (nothing here measures).

The memory calculators these build on are `zero_lab/memory.py`, at the top: outside checks
call them as `from zero_lab import memory` (the course's public API).

    projection.py  step time and stage choice on machines we do not have
    step_time.py   one training step projected: its collectives priced, compute beside them
    flops.py       a transformer's training FLOPs a token (recompute included), at an MFU
    micro_batches.py  gradient accumulation in the choice: what each stage sends and holds
    reasons.py     recommend()'s reasons in words
    links.py       what one collective costs on links we do not have (alpha-beta per link)
    knobs.py       the bytes notebook 08's knobs must send, from their construction
    recompute.py   when the memory stage 3 frees pays for turning recompute off

Their measured counterparts are in `zero_lab.measure`.
"""
