"""The generation engine: the drafter protocol, the one owner of KV-cache edits, single-row and batched
speculative generation."""
