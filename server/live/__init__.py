"""Live runs: the attached inspector as a source, what-if on it, the demo's training thread, its
shadow branch, and user mode (the dashboard inside the user's process)."""
