"""moeserve: an inference and serving engine for mixture-of-experts language models."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # `from moeserve import Engine` without importing torch for `moeserve plan`
    if name == "Engine":
        from moeserve.runtime.engine import Engine

        return Engine
    raise AttributeError(f"module 'moeserve' has no attribute {name!r}")
