"""Statistics: per-tensor measures, the per-step statistics and their one transfer, histograms,
update ratios, the deferred non-finite check, the sampling cadence and the sharded combination."""
