"""k "auto": the speculation policy, its acceptance tracker, cost model, allocator and calibration."""
