"""The report channel: engines and readers push their load reports and results to the scheduler over it
(the bottom of runtime/, beside transport/: every actor sends, only control/ receives).
"""
