# The public endpoint: an HTTPS-only application load balancer. /admin and /metrics (with any
# trailing part) are forwarded only from var.admin_cidrs, and a percent-encoded path from nowhere;
# the gateway's own admin credential applies on top.

resource "aws_lb" "gateway" {
  #checkov:skip=CKV_AWS_91:Every request is recorded by the gateway itself in PostgreSQL (requests table: timings, site, outcome); load-balancer access logs would duplicate that into a bucket needing its own policy and retention.
  #checkov:skip=CKV2_AWS_28:A WAF web ACL is an account-level choice with its own cost and rules; the gateway validates and size-limits every request itself. Attach one with aws_wafv2_web_acl_association if your organisation mandates it.
  region                     = var.region
  name                       = substr(local.name, 0, 32)
  internal                   = false
  load_balancer_type         = "application"
  security_groups            = [aws_security_group.load_balancer.id]
  subnets                    = var.public_subnet_ids
  drop_invalid_header_fields = true
  enable_deletion_protection = true
  # Long completions stream for minutes; the gateway enforces its own request timeout.
  idle_timeout = 900
  tags         = var.tags
}

resource "aws_lb_target_group" "gateway" {
  #checkov:skip=CKV_AWS_378:TLS terminates at the load balancer; the hop to the task stays inside the VPC's private subnets, admitted only from the load balancer's security group.
  region               = var.region
  name_prefix          = "fgw-"
  port                 = local.container_port
  protocol             = "HTTP"
  target_type          = "ip"
  vpc_id               = var.vpc_id
  deregistration_delay = var.drain_seconds
  # Liveness, not readiness: /readyz fails while every site is down, and the load balancer must
  # not have the gateway replaced for an outage elsewhere.
  health_check {
    path                = "/healthz"
    matcher             = "200"
    interval            = 15
    timeout             = 5
    healthy_threshold   = 2
    unhealthy_threshold = 3
  }
  tags = var.tags
  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_lb_listener" "https" {
  region            = var.region
  load_balancer_arn = aws_lb.gateway.arn
  port              = 443
  protocol          = "HTTPS"
  ssl_policy        = "ELBSecurityPolicy-TLS13-1-2-2021-06"
  certificate_arn   = var.certificate_arn
  default_action {
    type             = "forward"
    target_group_arn = aws_lb_target_group.gateway.arn
  }
  tags = var.tags
}

# The gateway's server decodes percent-escapes before routing ("/%61dmin" is "/admin" there), so
# a path the patterns below would not recognise could still reach the admin surface. No client
# API path needs an escape: any path with one is refused before the admin rules are consulted.
resource "aws_lb_listener_rule" "encoded_paths_refused" {
  region       = var.region
  listener_arn = aws_lb_listener.https.arn
  priority     = 5
  action {
    type = "fixed-response"
    fixed_response {
      content_type = "application/json"
      status_code  = "400"
      message_body = jsonencode({ error = { message = "percent-encoded paths are not accepted", type = "invalid_request_error", param = null, code = "encoded_path" } })
    }
  }
  condition {
    path_pattern {
      values = ["*%*"]
    }
  }
  tags = var.tags
}

resource "aws_lb_listener_rule" "admin_from_operators" {
  region       = var.region
  listener_arn = aws_lb_listener.https.arn
  priority     = 10
  action {
    type             = "forward"
    target_group_arn = aws_lb_target_group.gateway.arn
  }
  condition {
    path_pattern {
      values = local.admin_paths
    }
  }
  condition {
    source_ip {
      values = var.admin_cidrs
    }
  }
  tags = var.tags
}

resource "aws_lb_listener_rule" "admin_from_elsewhere" {
  region       = var.region
  listener_arn = aws_lb_listener.https.arn
  priority     = 20
  action {
    type = "fixed-response"
    fixed_response {
      content_type = "application/json"
      status_code  = "403"
      message_body = jsonencode({ error = { message = "the admin surface is not reachable from this address", type = "permission_error", param = null, code = "forbidden_network" } })
    }
  }
  condition {
    path_pattern {
      values = local.admin_paths
    }
  }
  tags = var.tags
}

resource "aws_route53_record" "api" {
  count   = var.route53_zone_id == null ? 0 : 1
  zone_id = var.route53_zone_id
  name    = var.domain_name
  type    = "A"
  alias {
    name                   = aws_lb.gateway.dns_name
    zone_id                = aws_lb.gateway.zone_id
    evaluate_target_health = true
  }
}
