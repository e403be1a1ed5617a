"""Models and generation, above the ES optimizer and the tasks: `loading` (the built-in tiny model, its
character tokenizer, loading and saving Hugging Face checkpoints, prompt formatting), `sources` (a model
named by a path, a .gguf file or a Hub id), `adapters` (PEFT adapters) and `generation` (batched
sampling with fastes' own seeded noise). Import the submodules directly.
"""
