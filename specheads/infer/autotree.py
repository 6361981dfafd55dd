import sys; import specheads.infer.scheduling.autotree as _m; sys.modules[__name__] = _m  # noqa: E702 (shim: this path is the module itself, so a monkeypatch of either reaches both)
