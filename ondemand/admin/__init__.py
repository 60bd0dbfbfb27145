"""The admin API, the web page, the deployment view, /metrics, the admin socket's client and
doctor's checks."""
