"""The rules, once, above the backends: the guard's verdict, the ticket's end, its views, the
request claim, cancel-in-progress."""
