"""Shards in object storage: reading them by URL and keeping them in a node-local cache."""
