"""The decoding core every caller shares: the front door that turns a request into rows (request.py), the loaded
bundle it admits them to (loaded.py), the in-flight scheduler that steps every running row (scheduler.py, with its
prefill, output processing and handles), and the engine-fault watch the servers' probes read (health.py). The servers
(runtime/serving/, triton_repo/) and the Python API (runtime/api.py) sit above it; nothing here imports them."""
