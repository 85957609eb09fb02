"""Hooks: the kinds' operations, the torch hooks that run them, the configuration (registry) and
how its changes are applied, the handles, and the hooks we own on the user's tensors."""
