from scale_cl.cli import main

raise SystemExit(main())
