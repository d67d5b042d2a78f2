"""The path of a completion request, one module and one owner per stage:

prepare (prepare.py) -> predict (predict.py) -> admit (admit.py) -> route (route.py) ->
dispatch (gateway/dispatch/stream.py) -> record (record.py).

service.py's CompletionService only sequences them; the API's controllers, chat and batches call
it (docs/architecture.md, "The request path").
"""
