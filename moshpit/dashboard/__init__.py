"""``moshpit dashboard``: a live web page of a run, built from what its peers publish.

- ``history.py``: what the dashboard keeps of a run (bounded) and the JSON it serves;
- ``app.py``: the ASGI app (the page, its script and style, ``/api/run.json``);
- ``server.py``: the DHT client that reads the run and hypercorn serving the app;
- ``static/``: the page, a hand-written script that polls the JSON and draws SVG charts, and
  its style sheet (shipped as package data: no CDN, nothing fetched from elsewhere).

Torch-free. hypercorn (the ``dashboard`` extra) is imported only when a dashboard starts.
See docs/dashboard.md.
"""
