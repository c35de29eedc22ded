"""The process and its device: compute device and dtype, host-memory settings, memory stats, metrics lines."""
