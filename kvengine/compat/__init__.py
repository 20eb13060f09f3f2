"""Compatibility layers: other engines' Python APIs over kvengine.

- ``kvengine.compat.llm_datadist``: LLM-DataDist V2's Python API (CacheManager
  mode) over :mod:`kvengine.sync` (docs/llm_datadist.md is the porting guide).
"""
