from validate.cli import main

raise SystemExit(main())
