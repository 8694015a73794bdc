"""The HTTP service layer every rl360 server runs on (`app`: FastAPI + uvicorn with keys, limits, deadlines,
graceful shutdown, `/health`; `metrics`: Prometheus-format counters and histograms)."""
