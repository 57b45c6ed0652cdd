"""Tenants and their limits: who a request is (`tenants`), its tenant's limits counted by
this replica (`local`) or shared by every replica through Redis (`shared`, over the Redis
client `redis`)."""
