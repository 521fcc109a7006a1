"""Hydra configuration of lightning_sync; ships in the wheel as ``lightning_sync.conf``."""
