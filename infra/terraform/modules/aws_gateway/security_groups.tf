# Load balancer -> gateway tasks -> {database, predictor file system, sites}. Every rule names its
# peer; the only world-facing port is the load balancer's HTTPS listener.

resource "aws_security_group" "load_balancer" {
  region      = var.region
  name_prefix = "${local.name}-lb-"
  description = "fedllm gateway load balancer: HTTPS from the API's clients"
  vpc_id      = var.vpc_id
  tags        = merge(var.tags, { Name = "${local.name}-lb" })
  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_vpc_security_group_ingress_rule" "load_balancer_https" {
  count             = length(var.public_cidrs)
  region            = var.region
  security_group_id = aws_security_group.load_balancer.id
  description       = "HTTPS from API clients"
  ip_protocol       = "tcp"
  from_port         = 443
  to_port           = 443
  cidr_ipv4         = var.public_cidrs[count.index]
}

resource "aws_vpc_security_group_egress_rule" "load_balancer_to_tasks" {
  region                       = var.region
  security_group_id            = aws_security_group.load_balancer.id
  description                  = "To the gateway tasks"
  ip_protocol                  = "tcp"
  from_port                    = local.container_port
  to_port                      = local.container_port
  referenced_security_group_id = aws_security_group.tasks.id
}

resource "aws_security_group" "tasks" {
  region      = var.region
  name_prefix = "${local.name}-tasks-"
  description = "fedllm gateway tasks"
  vpc_id      = var.vpc_id
  tags        = merge(var.tags, { Name = "${local.name}-tasks" })
  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_vpc_security_group_ingress_rule" "tasks_from_load_balancer" {
  region                       = var.region
  security_group_id            = aws_security_group.tasks.id
  description                  = "HTTP from the load balancer"
  ip_protocol                  = "tcp"
  from_port                    = local.container_port
  to_port                      = local.container_port
  referenced_security_group_id = aws_security_group.load_balancer.id
}

resource "aws_vpc_security_group_egress_rule" "tasks_https" {
  region            = var.region
  security_group_id = aws_security_group.tasks.id
  description       = "HTTPS to the image registry, Hugging Face (tokenizers) and AWS APIs"
  ip_protocol       = "tcp"
  from_port         = 443
  to_port           = 443
  cidr_ipv4         = "0.0.0.0/0"
}

# count, not for_each: the sites' addresses are only known once they exist.
resource "aws_vpc_security_group_egress_rule" "tasks_to_sites" {
  count             = length(var.site_cidrs)
  region            = var.region
  security_group_id = aws_security_group.tasks.id
  description       = "gRPC to a site engine"
  ip_protocol       = "tcp"
  from_port         = var.grpc_port
  to_port           = var.grpc_port
  cidr_ipv4         = var.site_cidrs[count.index]
}

resource "aws_vpc_security_group_egress_rule" "tasks_to_database" {
  region                       = var.region
  security_group_id            = aws_security_group.tasks.id
  description                  = "PostgreSQL"
  ip_protocol                  = "tcp"
  from_port                    = 5432
  to_port                      = 5432
  referenced_security_group_id = aws_security_group.database.id
}

resource "aws_vpc_security_group_egress_rule" "tasks_to_predictor_store" {
  region                       = var.region
  security_group_id            = aws_security_group.tasks.id
  description                  = "NFS to the predictor file system"
  ip_protocol                  = "tcp"
  from_port                    = 2049
  to_port                      = 2049
  referenced_security_group_id = aws_security_group.predictor_store.id
}

resource "aws_security_group" "database" {
  region      = var.region
  name_prefix = "${local.name}-db-"
  description = "fedllm gateway database: PostgreSQL from the gateway tasks only"
  vpc_id      = var.vpc_id
  tags        = merge(var.tags, { Name = "${local.name}-db" })
  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_vpc_security_group_ingress_rule" "database_from_tasks" {
  region                       = var.region
  security_group_id            = aws_security_group.database.id
  description                  = "PostgreSQL from the gateway tasks"
  ip_protocol                  = "tcp"
  from_port                    = 5432
  to_port                      = 5432
  referenced_security_group_id = aws_security_group.tasks.id
}

resource "aws_security_group" "predictor_store" {
  region      = var.region
  name_prefix = "${local.name}-efs-"
  description = "fedllm predictor file system: NFS from the gateway tasks only"
  vpc_id      = var.vpc_id
  tags        = merge(var.tags, { Name = "${local.name}-efs" })
  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_vpc_security_group_ingress_rule" "predictor_store_from_tasks" {
  region                       = var.region
  security_group_id            = aws_security_group.predictor_store.id
  description                  = "NFS from the gateway tasks"
  ip_protocol                  = "tcp"
  from_port                    = 2049
  to_port                      = 2049
  referenced_security_group_id = aws_security_group.tasks.id
}
