"""placeholder"""
MONITOR_HELP = ""
MONITOR_DESCRIPTION = ""
def add_monitor_arguments(p): pass
