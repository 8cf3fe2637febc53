"""Asynchronous parameter-server training over a LAN: `ps` (server.py) and `worker` (worker.py)."""
