"""The command-line tools other than ``syncbn demo`` and ``syncbn bench``, and the
instruments they and the tests share (PyTorch, but for the last two):

- :mod:`~syncbn.tools.verify`: ``syncbn verify``, does a user's model train exactly like
  one process on the whole batch;
- :mod:`~syncbn.tools.soak`: ``syncbn soak``, many steps with flat memory, fds, threads;
- :mod:`~syncbn.tools.launch`: a pool of local processes in one ``torch.distributed``
  group, started once and reused;
- :mod:`~syncbn.tools.traffic`: the collectives and payloads the process group really
  executed;
- :mod:`~syncbn.tools.memory`: the bytes saved for backward and a step's peak memory;
- :mod:`~syncbn.tools.usage`, :mod:`~syncbn.tools.output`: what every ``syncbn``
  subcommand (``demo`` and ``bench`` too) shares on its command line: a usage error
  (exit status 2) in one line, "needs PyTorch", an ``--out`` folder checked before any
  work. These two import no framework.

A tool imports the library (``syncbn.torch``) and these instruments, never the reverse.
"""
