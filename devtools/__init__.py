"""Tools for developers, tests and benchmarks, outside the packages that are deployed: the demo
(which builds and converts models through site_engine), starting real site and gateway
processes on this machine, and measuring what the container images install."""
