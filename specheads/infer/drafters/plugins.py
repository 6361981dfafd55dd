"""Drafter kinds from the user's own code: `--plugin MODULE` or `--plugin FILE.py` imports it before anything is
built, and its `register_drafter(DrafterKind(...))` calls make `--drafter NAME` (generate) and the `drafter:NAME`
bench method exist. Only what the user names is imported (their own code, as with any Python import)."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from specheads.utils import SpecheadsError


def load_plugin(spec: str, flag: str = "--plugin") -> ModuleType:
    """Import `spec`: a path ending in .py (loaded under its file stem) or a dotted module name on sys.path."""
    if spec.endswith(".py"):
        path = Path(spec)
        if not path.is_file():
            raise SpecheadsError(f"{flag} {spec}: no such file")
        name = f"specheads_plugin_{path.stem}"
        if name in sys.modules:
            return sys.modules[name]
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[name]
            raise SpecheadsError(f"{flag} {spec}: importing it failed: {type(e).__name__}: {e}") from None
        return module
    try:
        return importlib.import_module(spec)
    except ModuleNotFoundError as e:
        raise SpecheadsError(f"{flag} {spec}: no module {e.name!r} (give a dotted module on the Python path or a "
                             f"FILE.py)") from None
    except Exception as e:
        raise SpecheadsError(f"{flag} {spec}: importing it failed: {type(e).__name__}: {e}") from None


def load_plugins(specs: list[str] | None) -> None:
    for spec in specs or []:
        load_plugin(spec)
