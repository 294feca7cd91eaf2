"""Our drafters in llama.cpp (docs/llamacpp.md): the GGUF export (`export.py`), the llama.cpp build and
its timings (`runtime.py`) and the `--spec-draft-p-min` / `--spec-draft-n-max` it should run with
(`settings.py`). llama.cpp is optional: nothing here imports it, and what needs its binaries says so."""
