"""What-if: checkpoints and rewind inside the run, and `compare()` of two branches."""
