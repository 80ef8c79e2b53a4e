"""Run services that any trainer uses and none of them owns: checkpoint io and contents, the run lock, preemption
signals, out-of-memory messages, profiling, metric loggers and experiment trackers, and the CPU thread pool of
a simulated mesh."""
