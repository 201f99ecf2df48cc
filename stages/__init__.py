"""The stages of raymill, one package each, on a ground floor (`stages.common`).

Floors, lowest first (ARCHITECTURE.md; checked by tests/test_architecture.py):
common < etl < feed < model < train, infer, serve < tune. A package imports only the ones below it.
"""
