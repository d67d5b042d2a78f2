"""Capacity that follows load: a controller turns each model's predicted work into a desired
number of sites, and an actuator (local processes, Kubernetes pods, or the metric alone) carries
it out (docs/elastic.md)."""
