"""`replay view`: a read-only web app over an event log (runs, sessions, turns, samples, rules).

`serve.serve` runs it; `app.make_app` builds the aiohttp application (tests
drive it with aiohttp's test client and with a real browser).
"""
