"""Tenant limits kept in a store shared by every router replica (`[limits] store = "redis"`)."""
