"""The process's life: its start, its stop, a restart and a reload.

* :mod:`.limits`: the open-file budget at start (the connection cap that fits);
* :mod:`.sdnotify`: systemd's notify protocol (``READY=1``, the watchdog, a reload's ``MAINPID=``);
* :mod:`.holdstore`: the holds file, so a restart (a crash too) keeps the holds;
* :mod:`.drain`: the graceful stop's middle, the parked and in-flight requests settled;
* :mod:`.succession`: a reload or upgrade, one process handing everything over to the next.

Layer 9: it may import the core, servers/, observe/, edge/, lot/, upstream/,
watchers/, schedule/ and proxy/; nothing of the admin API's, the composition roots' or the tools'.
"""
