"""The dashboard's static files (HTML, ES modules, CSS), shipped as package data.

The server (``server.app.frontend_dir``) finds them as files on disk: the folder of this
package, located with ``importlib.util.find_spec("frontend")`` without importing it, else
the ``frontend/`` folder beside ``server/`` in a checkout; it serves them from there. There
is no build step.
"""
