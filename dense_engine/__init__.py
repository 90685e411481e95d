"""dense_engine: the engine around dense.py (the model), in floors a reader climbs: system/ (this machine, errors),
cpu/ (kernels, quantized linears), formats/ (checkpoints, GGUF, loading, vocabularies), runtime/ (generation,
compiled steps, sessions, speculative, tensor parallel), api.py (the Python API), cli/ and server/ (the programs).

    import dense_engine
    llm = dense_engine.load("path/to/ckpt")
    print(llm.generate("Once upon a time", max_new_tokens=32))
"""

__all__ = ["LLM", "LoadRecord", "SamplerSettings", "Session", "Settings", "load"]


def __getattr__(name: str):
    """The API's names, imported on first use: `import dense_engine.system.machine` stays light."""
    if name in ("load", "LLM"):
        from dense_engine import api

        return getattr(api, name)
    if name == "LoadRecord":
        from dense_engine.formats import load

        return load.LoadRecord
    if name in ("Session", "Settings"):
        from dense_engine.runtime import session

        return getattr(session, name)
    if name == "SamplerSettings":
        from dense_engine.runtime import sampling

        return sampling.SamplerSettings
    raise AttributeError(f"module 'dense_engine' has no attribute {name!r}")
