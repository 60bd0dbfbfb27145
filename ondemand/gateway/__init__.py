"""The gateway: the routes a request takes (checks, body, admission, answer), the peer guard, the
path check, the key and its watcher, the failed-key limit, the queued notice, the access log."""
