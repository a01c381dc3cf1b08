"""Approval policies and requests arrive with the hold-points issue."""
