"""The dashboard's static files (HTML, ES modules, CSS), shipped as package data.

The server locates them with ``importlib.resources.files("frontend")``; there is no
build step.
"""
