from bench.elastic.run import main

raise SystemExit(main())
