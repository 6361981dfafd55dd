"""The generation engine: the drafter protocol (with the step clock and step report the scheduler reads), the
target's forward (runner, owned), single-row and batched speculative generation. Cache edits go through
specheads/kvcache.py. The lowest infer/ folder: it imports neither scheduling/ nor drafters/."""
