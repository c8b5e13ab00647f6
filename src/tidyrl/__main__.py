from tidyrl.cli import main

raise SystemExit(main())
