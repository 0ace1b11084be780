"""Tenants: authentication, admission, limits, metering, the adapter catalog, and how they start."""
