"""Reading data sources into rows, with no target: `load.load_conversations`, `load.load_texts` (load.py), the raw
rows of a file, hub dataset or `datasets.Dataset` (sources.py) and the forms of a message (messages.py). A leaf:
it imports `utils` and `assets` only, so `prompts` and `train/` both stand on it."""
