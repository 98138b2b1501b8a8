"""Thin KFP components for batchpilot (see ops.py)."""
