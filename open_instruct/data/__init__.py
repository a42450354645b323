"""data: what a run reads. Prompt datasets (sources, the mixer, row schemas, chat templates, tokenisation and its
cache), the tokenizer, prompt batches and the prompt order, and the embedded default (SmolLM2-135M and the arithmetic
task) in build-once cache folders that are checked at each use (cache_folders).
May import: rl; third-party libraries (datasets, transformers, torch). Nothing here loads a model for training.
"""
