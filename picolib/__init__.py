"""picolib — distributed LLM training, one readable file per technique.

Start with `picolib.launch.run` (lesson 00) and `picolib.model.TinyLlama` (lesson 01).
"""
__version__ = "0.1.0"
