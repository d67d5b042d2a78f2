"""Admin dashboard benchmark: page load time and bytes sent with a day of 9-site history.

`python -m bench.dashboard` seeds a database with 24 h of load samples for 9 sites at the
sampler's resolution (10 s: ~78k rows) plus a day of predicted requests, starts the gateway on
it, and loads /admin?window=86400 in the Debian Chromium (fresh browser context each time, so
nothing is cached): time from navigation to the charts drawn, and bytes on the wire by kind.
Results: bench/results/dashboard/dashboard.json and .md.
"""
