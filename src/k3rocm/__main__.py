from k3rocm.cli import main

raise SystemExit(main())
